"""Bridges to other engines and formats: a Hugging Face export, a proposer for vLLM."""
