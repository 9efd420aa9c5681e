"""Integrations with the libraries users already run (Hugging Face transformers: `kvbound.hf`)."""
