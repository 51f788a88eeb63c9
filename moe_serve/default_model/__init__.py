"""Built-in checkpoints that need no network: a tiny random MoE, and SmolLM2 upcycled into a 4-expert MoE."""
