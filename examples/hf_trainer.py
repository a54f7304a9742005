"""A Hugging Face Trainer script, tuned by autotune: the lines marked ``# autotune`` are all it adds.

    python examples/hf_trainer.py                 # tune it; prints the TrainingArguments to paste

A GPT-2 built from a local ``GPT2Config`` (no weights or data are downloaded) learns synthetic token
streams: the next token is a fixed successor of the current one 90% of the time, so the eval loss falls
well below chance and the accuracy verdict has something to compare. ``HF_TRAINER_SIZE=small`` (the default
with a GPU: 6 layers, d_model 512, 512 tokens) or ``tiny`` (the default on a CPU: 2 layers, d_model 32, 32
tokens, seconds per trial). The space is ``search_spaces/hf_trainer.yaml``; ``tune(args=ARGS)`` starts
from these TrainingArguments, so the study keeps their global batch.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here: never reach the Hub

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from autotune.integrations import transformers as tuned  # autotune

SIZES = {
    "small": {"n_layer": 6, "n_embd": 512, "n_head": 8, "n_positions": 512, "vocab_size": 32000},
    "tiny": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32, "vocab_size": 256},
}
SIZE = SIZES[os.environ.get("HF_TRAINER_SIZE") or ("small" if torch.cuda.is_available() else "tiny")]
FOLLOW = 0.9  # how often the next token is the current one's fixed successor


class TokenStreams(torch.utils.data.Dataset):
    """``n`` sequences of ``n_positions`` tokens over 256 of the vocabulary, as ``{"input_ids", "labels"}``."""

    def __init__(self, n: int, *, seed: int) -> None:
        fixed = torch.Generator().manual_seed(1234)
        tokens = torch.randperm(SIZE["vocab_size"], generator=fixed)[:256]
        successor = torch.randperm(256, generator=fixed)
        gen = torch.Generator().manual_seed(seed)
        index = torch.empty(n, SIZE["n_positions"], dtype=torch.long)
        index[:, 0] = torch.randint(0, 256, (n,), generator=gen)
        jumps = torch.rand(index.shape, generator=gen) > FOLLOW
        random_next = torch.randint(0, 256, index.shape, generator=gen)
        for t in range(1, index.shape[1]):
            index[:, t] = torch.where(jumps[:, t], random_next[:, t], successor[index[:, t - 1]])
        self.sequences = tokens[index]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.sequences[i], "labels": self.sequences[i]}  # the model shifts the labels


ARGS = TrainingArguments(
    output_dir="hf_trainer_output",
    per_device_train_batch_size=32,
    per_device_eval_batch_size=64,
    learning_rate=3e-3 if SIZE is SIZES["tiny"] else 6e-4,
    weight_decay=0.1,
    warmup_steps=4,
    lr_scheduler_type="cosine",
    max_grad_norm=1.0,
    optim="adamw_torch",
    num_train_epochs=1,
    eval_strategy="epoch",
    logging_steps=50,
    report_to="none",
)


def build_trainer(args: TrainingArguments) -> Trainer:
    model = GPT2LMHeadModel(GPT2Config(**SIZE, bos_token_id=0, eos_token_id=0))
    return Trainer(model=model, args=args, train_dataset=TokenStreams(4096, seed=0),
                   eval_dataset=TokenStreams(256, seed=10_000))


def train(ctx) -> None:                                                    # autotune
    tuned.run_trainer(ctx, build_trainer, ARGS)                            # autotune


if __name__ == "__main__":
    result = tuned.tune(train, args=ARGS, n_trials=20)                     # autotune
    print(result.verdict)                                                  # autotune
    print(tuned.training_arguments(result.best_config, ARGS))              # autotune
