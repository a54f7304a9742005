"""A GPT-2 (Hugging Face transformers, GPT-2 small's shape built from its config) trained by the ``Trainer``.

A script as a user writes it, for ``benchmarks/runners/answer_first_h200.py``: no earlier result was tuned
on it. It keeps its ``TrainingArguments`` and a function that builds the ``Trainer`` from them, and is tuned
through autotune's Trainer adapter as ``docs/trainers.md`` shows (``tuned.run_trainer`` in ``train``,
``tuned.tune(train, args=ARGS)``). Nothing is downloaded: the model is ``GPT2LMHeadModel(GPT2Config())``
(12 layers, d_model 768, the 50,257-token vocabulary), and the data are synthetic token streams of 256
tokens, tokenized once at construction: over 1,024 tokens of the vocabulary, the next token is the current
one's fixed successor 85% of the time, so the eval loss falls well below chance. The arguments train at
``per_device_train_batch_size=32`` in fp32 with ``adamw_torch``, a cosine schedule and no loader workers,
as a first script does.

``AUTOTUNE_BENCH_SIZE=tiny``: two layers of d_model 32 over a 512-token vocabulary, 32-token streams, batch 16
(a check on a CPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: never reach the Hub

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from autotune.integrations import transformers as tuned

TINY = os.environ.get("AUTOTUNE_BENCH_SIZE") == "tiny"
SHAPE = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 512} if TINY else {}
LENGTH, ALPHABET, FOLLOW = (32, 256, 0.85) if TINY else (256, 1024, 0.85)


class TokenStreams(torch.utils.data.Dataset):
    """``n`` sequences of ``LENGTH`` tokens, as ``{"input_ids", "labels"}`` (the model shifts the labels)."""

    def __init__(self, n: int, *, seed: int) -> None:
        vocab = GPT2Config(**SHAPE).vocab_size
        fixed = torch.Generator().manual_seed(1234)
        tokens = torch.randperm(vocab, generator=fixed)[:ALPHABET]
        successor = torch.randperm(ALPHABET, generator=fixed)
        gen = torch.Generator().manual_seed(seed)
        index = torch.empty(n, LENGTH, dtype=torch.long)
        index[:, 0] = torch.randint(0, ALPHABET, (n,), generator=gen)
        jumps = torch.rand(index.shape, generator=gen) > FOLLOW
        random_next = torch.randint(0, ALPHABET, index.shape, generator=gen)
        for t in range(1, LENGTH):
            index[:, t] = torch.where(jumps[:, t], random_next[:, t], successor[index[:, t - 1]])
        self.sequences = tokens[index]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.sequences[i], "labels": self.sequences[i]}


ARGS = TrainingArguments(
    output_dir="gpt2_trainer_output",
    per_device_train_batch_size=16 if TINY else 32,
    per_device_eval_batch_size=64,
    learning_rate=3e-3 if TINY else 6e-4,
    weight_decay=0.1,
    warmup_steps=10,
    lr_scheduler_type="cosine",
    max_grad_norm=1.0,
    optim="adamw_torch",
    num_train_epochs=1,
    eval_strategy="epoch",
    logging_steps=50,
    report_to="none",
)


def build_trainer(args: TrainingArguments) -> Trainer:
    model = GPT2LMHeadModel(GPT2Config(**SHAPE, bos_token_id=0, eos_token_id=0))
    return Trainer(model=model, args=args, train_dataset=TokenStreams(512 if TINY else 8192, seed=0),
                   eval_dataset=TokenStreams(64 if TINY else 256, seed=10_000))


def train(ctx) -> None:
    tuned.run_trainer(ctx, build_trainer, ARGS)


if __name__ == "__main__":
    result = tuned.tune(train, args=ARGS, budget=4)
    print(tuned.training_arguments(result.best_config, ARGS))
