"""``torchvision.transforms``, imported by torchmetrics at load time; empty here."""
