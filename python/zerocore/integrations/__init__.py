"""Integrations with other frameworks, each imported on use (and needing
that framework): zerocore.integrations.hf, the Hugging Face Trainer."""
