"""Framework adapters: raw PyTorch, accelerate, trl, axolotl."""
