"""ampscaler: dynamic loss scaling for mixed-precision PyTorch training."""
