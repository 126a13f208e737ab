"""A model fleet: one OpenAI-compatible endpoint for many models on one device, more
models than fit, each a sleepable tenant of the kvpool daemon (``kvpool fleet``)."""
