"""Loading MoE checkpoints and generating tokens: no UI code, no text inside the engine."""
