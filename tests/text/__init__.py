"""Tests of the text layer: the GGUF tokenizer and chat templates."""
