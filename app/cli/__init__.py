"""The `tandem` command line: the parser and each command's body (`main`), the flags and how they become a load's
settings (`flags`, `from_flags`), batch mode's command and file format, where results and prompts come from and go."""
