"""The `tandem` command line and chat front end. The only package that may import textual."""
