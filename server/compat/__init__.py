"""What TorchServe users already have, read and written as TorchServe does."""
