"""smp.nn.huggingface.<family>: state-dict translation functions (spec §2.11)."""
