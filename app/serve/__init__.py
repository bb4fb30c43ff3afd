"""`tandem serve`: the OpenAI-compatible HTTP server (`server`), the engine shared by its requests (`serving`), the
API's request and response shapes (`openai_api`), the command (`command`) and its benchmarks beside llama-server
(`bench`, `bench_turns`)."""
