"""One device: the model, its KV pool, and running steps on it."""
