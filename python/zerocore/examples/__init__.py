"""Runnable examples: a small GPT-style model, its mixture-of-experts
variant and the main training job.

    python -m zerocore.examples.train --stage 3 --ranks 2
    python -m zerocore.examples.train --model moe --stage 2

See :mod:`zerocore.examples.gpt` for the model and data,
:mod:`zerocore.examples.moe` for the mixture of experts and
:mod:`zerocore.examples.train` for the job.
"""

from zerocore.examples.gpt import GPT, GPTConfig, CharTokenizer, TextData, batches, load_corpus
from zerocore.examples.moe import MoEConfig, MoEGPT

__all__ = ["GPT", "GPTConfig", "MoEGPT", "MoEConfig", "CharTokenizer", "TextData", "batches", "load_corpus"]
