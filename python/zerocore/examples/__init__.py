"""Runnable examples: a small GPT-style model and the main training job.

    python -m zerocore.examples.train --stage 3 --ranks 2

See :mod:`zerocore.examples.gpt` for the model and data and
:mod:`zerocore.examples.train` for the job.
"""

from zerocore.examples.gpt import GPT, GPTConfig, CharTokenizer, TextData, batches, load_corpus

__all__ = ["GPT", "GPTConfig", "CharTokenizer", "TextData", "batches", "load_corpus"]
