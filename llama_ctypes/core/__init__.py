"""Core objects: Model, Context, Batch, Sampler, Tokenizer, and single-sequence generation."""
