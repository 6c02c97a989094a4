"""Model building blocks; each loads its own weights through ``weight_loader``."""
