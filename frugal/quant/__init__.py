"""Weight quantization: INT4 (W4A16, group-wise) in memory and on disk."""
