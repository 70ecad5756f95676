"""Target model code (Llama family), the checkpoint loader and the architecture registry."""
