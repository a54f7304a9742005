# examples/word_lm.py
"""A word-level language model in the shape of PyTorch's word_language_model example, adapted for autotune.

The script keeps what such a script has: argparse options, an LSTM whose hidden state carries from batch
to batch (truncated backpropagation through time), gradient clipping, plain SGD and a learning rate annealed
per epoch on the validation loss. Its corpus is generated (a seeded token stream with structure an LSTM can
learn), so it needs no download.

    python examples/word_lm.py --epochs 3                                   # train, as before
    autotune tune examples/word_lm.py:train --batch-size 20 --metric-direction minimize \\
        --max-accuracy-loss 0.05 -- --emsize 64 --nhid 64                   # tune it, with its own options

docs/adapting-a-script.md walks through what changed and why.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="LSTM word language model")
    parser.add_argument("--tokens", type=int, default=20_000, help="length of the generated training corpus")
    parser.add_argument("--vocab", type=int, default=200, help="vocabulary size")
    parser.add_argument("--emsize", type=int, default=64, help="size of the word embeddings")
    parser.add_argument("--nhid", type=int, default=64, help="hidden units per layer")
    parser.add_argument("--nlayers", type=int, default=2, help="LSTM layers")
    parser.add_argument("--lr", type=float, default=20.0, help="initial learning rate")
    parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
    parser.add_argument("--epochs", type=int, default=6, help="epochs (outside a study)")
    parser.add_argument("--batch-size", type=int, default=20, help="parallel streams per batch")
    parser.add_argument("--bptt", type=int, default=35, help="sequence length of truncated BPTT")
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1111, help="seed of the generated corpus")
    return parser.parse_args(argv)


# -- data -----------------------------------------------------------------------------------------------
def make_corpus(tokens: int, vocab: int, seed: int) -> torch.Tensor:
    """A token stream with learnable structure: each token mostly follows from the one before it, and a
    fifth of them is noise (the loss has a floor)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(vocab, (vocab,), generator=g).tolist()
    noise = (torch.rand(tokens, generator=g) < 0.2).tolist()
    random = torch.randint(vocab, (tokens,), generator=g).tolist()
    out = [random[0]]
    for i in range(1, tokens):
        out.append(random[i] if noise[i] else table[out[-1]])
    return torch.tensor(out)


class StreamChunks(torch.utils.data.Dataset):
    """The corpus as ``streams`` parallel streams cut into ``bptt``-token chunks, in the order truncated BPTT
    reads them: sample ``i`` is chunk ``i // streams`` of stream ``i % streams``, so a sequential loader's
    batch of ``streams`` samples is one step of every stream, and the next batch continues each of them."""

    def __init__(self, data: torch.Tensor, *, streams: int, bptt: int) -> None:
        length = (data.numel() - 1) // streams
        self.inputs = data[: streams * length].view(streams, length)
        self.targets = data[1: streams * length + 1].view(streams, length)
        self.streams, self.bptt = streams, bptt
        self.chunks = length // bptt

    def __len__(self) -> int:
        return self.chunks * self.streams

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk, stream = divmod(i, self.streams)
        span = slice(chunk * self.bptt, (chunk + 1) * self.bptt)
        return self.inputs[stream, span], self.targets[stream, span]


# -- model ----------------------------------------------------------------------------------------------
class RNNModel(nn.Module):
    """Embedding, LSTM and decoder, as the example's ``RNNModel('LSTM', ...)`` (batch first here)."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(self.nlayers, batch, self.nhid, device=device)
        return zeros, zeros.clone()


class CarriedState(nn.Module):
    """The model with its hidden state carried from one batch to the next, detached (truncated BPTT).

    ``ctx.train_step`` calls ``model(inputs)``: this wrapper keeps the state the script's loop used to pass.
    A trial that accumulates gradients splits each batch into ``slots`` micro-batches (the first half of the
    streams, then the second): each slot keeps its own streams' state.
    """

    def __init__(self, model: nn.Module, *, slots: int = 1) -> None:
        super().__init__()
        self.model = model
        self.slots = slots
        self.hidden: list = [None] * slots
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        slot = self.calls % self.slots
        self.calls += 1
        state = self.hidden[slot]
        if state is None or state[0].size(1) != tokens.size(0):
            state = _inner(self.model).init_hidden(tokens.size(0), tokens.device)
        output, state = self.model(tokens, state)
        self.hidden[slot] = tuple(h.detach() for h in state)
        return output


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # under torch.compile, the module it wraps


def lm_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, *, streams: int, bptt: int, device: torch.device,
             autocast=contextlib.nullcontext) -> float:
    """Mean next-token loss (nats) over ``data``, the state carried as in training."""
    model.eval()
    chunks = StreamChunks(data, streams=streams, bptt=bptt)
    if not chunks.chunks:
        raise ValueError(f"the validation data ({data.numel()} tokens) holds no {bptt}-token chunk in {streams} streams")
    hidden, total, count = _inner(model).init_hidden(streams, device), 0.0, 0
    for c in range(chunks.chunks):
        span = slice(c * bptt, (c + 1) * bptt)
        inputs, targets = chunks.inputs[:, span].to(device), chunks.targets[:, span].to(device)
        with autocast():
            output, hidden = model(inputs, hidden)
        total += lm_loss(output.float(), targets).item() * targets.numel()
        count += targets.numel()
    model.train()
    return total / count


def corpus(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    data = make_corpus(args.tokens + args.tokens // 10, args.vocab, args.seed)
    return data[: args.tokens], data[args.tokens:]


# -- training, as autotune runs it ----------------------------------------------------------------------
def train(ctx) -> None:
    """One run: a trial in a study, or the whole training with a config you pass (``TrialContext``)."""
    args = parse_args()  # the trial's sys.argv: the arguments after -- on autotune's command line
    torch.manual_seed(ctx.seed)
    train_data, val_data = corpus(args)
    ctx.record("script_args", {"emsize": args.emsize, "nhid": args.nhid, "batch_size": args.batch_size})
    model = ctx.model(RNNModel(args.vocab, args.emsize, args.nhid, args.nlayers, args.dropout))
    carried = CarriedState(model, slots=ctx.config.accumulation_steps)
    optimizer = ctx.optimizer(torch.optim.SGD, model.parameters(), lr=args.lr)  # the example's manual SGD
    step = ctx.train_step(carried, optimizer, lm_loss, clip_grad_norm=args.clip)
    # In order, not shuffled: the state carries from one batch to the next. The batch is the script's own.
    loader = ctx.loader(StreamChunks(train_data, streams=args.batch_size, bptt=args.bptt),
                        batch_size=args.batch_size, shuffle=False)
    lr, best = args.lr, math.inf
    # A trial trains for its budget: one pass of ctx.batches, with no annealing (its length is not an epoch);
    # autotune train one epoch per pass for the run's length, the validation and annealing between passes.
    for epoch in ctx.epochs(range(args.epochs)):
        started = time.perf_counter()
        for inputs, targets in ctx.batches(loader):
            step(inputs, targets)
        val_loss = evaluate(model, val_data, streams=10, bptt=args.bptt, device=ctx.device, autocast=ctx.autocast)
        if not ctx.in_study:
            print(f"epoch {epoch + 1}: {time.perf_counter() - started:.1f} s, lr {lr:g}, valid loss {val_loss:.3f}, "
                  f"ppl {math.exp(val_loss):.1f}")
            if val_loss < best:
                best = val_loss
            else:  # the example's annealing: divide the learning rate by 4 when validation stops improving
                lr /= 4.0
                for group in optimizer.param_groups:
                    group["lr"] = lr
    ctx.report_metric(val_loss)  # nats: tune with --metric-direction minimize


def main(args: argparse.Namespace) -> None:
    """Train as the script always did: its own loop, its own options, no autotune."""
    import autotune

    train(autotune.TrialContext(config=autotune.TrialConfig(batch_size=args.batch_size), seed=args.seed))


if __name__ == "__main__":
    main(parse_args())
