"""Hardware probing, microbenchmarks and planning: pure functions of what was measured."""
