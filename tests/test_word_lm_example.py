"""What a third-party script needs, each with the example the docs show (``docs/adapting-a-script.md``
sections 8 and 9, ``examples/word_lm.py``): the state carried across batches, ``ctx.in_study``, the
script's own loop with its annealing, and a bound for a loss metric."""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autotune import TrialConfig, TrialContext
from autotune.study._verdict import ReferenceBand, judge

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

import word_lm  # noqa: E402


def test_the_docs_show_carried_state_as_the_example_has_it() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "adapting-a-script.md").read_text(), flags=re.S)
    shown = [b for b in blocks if b.startswith("class CarriedState")]
    assert shown == [inspect.getsource(word_lm.CarriedState)]


def _model() -> word_lm.RNNModel:
    torch.manual_seed(0)
    return word_lm.RNNModel(ntoken=30, ninp=8, nhid=8, nlayers=1, dropout=0.0).eval()


def test_the_state_carries_from_one_batch_to_the_next_detached_one_per_slot() -> None:
    """Two micro-batch slots, as a trial accumulating twice: calls alternate between them, and each slot's
    state is the model's own after its previous call (the script's loop passing ``hidden`` on), detached."""
    model = _model()
    carried = word_lm.CarriedState(model, slots=2)
    first, second, third = (torch.randint(30, (4, 5), generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.no_grad():
        hidden = model.init_hidden(4, torch.device("cpu"))
        expected_first, hidden = model(first, hidden)
        expected_third, hidden_after = model(third, hidden)
        fresh_second, _ = model(second, model.init_hidden(4, torch.device("cpu")))
    carried.train(False)
    with torch.no_grad():
        assert torch.equal(carried(first), expected_first)  # slot 0, a fresh state
        assert torch.equal(carried(second), fresh_second)  # slot 1: its own fresh state, not slot 0's
        assert torch.equal(carried(third), expected_third)  # slot 0 again: continues from its first call
    assert not torch.allclose(expected_third, model(third, model.init_hidden(4, torch.device("cpu")))[0])
    assert all(torch.equal(h, e) for h, e in zip(carried.hidden[0], hidden_after))
    # With gradients on, the kept state is detached: no backward reaches into an earlier batch.
    carried.train(True)
    carried(first).sum().backward()
    assert not any(h.requires_grad for slot in carried.hidden for h in slot)


def test_in_study_is_false_for_a_context_built_to_train_with_the_pick() -> None:
    ctx = TrialContext(config=TrialConfig(batch_size=8))
    assert ctx.in_study is False


def test_the_script_trains_as_it_always_did_its_epochs_and_annealing() -> None:
    """``python examples/word_lm.py`` runs the script's own loop outside any study: every epoch, and a learning
    rate divided by 4 when the validation loss stops improving (a far too large rate makes it stop)."""
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "word_lm.py"), "--epochs", "4", "--tokens", "3000",
                           "--emsize", "16", "--nhid", "16", "--nlayers", "1", "--bptt", "10", "--lr", "400"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rates = [float(m) for m in re.findall(r"^epoch \d+: [\d.]+ s, lr ([\d.e+-]+),", proc.stdout, flags=re.M)]
    assert len(rates) == 4, proc.stdout
    assert rates[0] == 400.0 and all(b in (a, a / 4.0) for a, b in zip(rates, rates[1:])), rates
    assert rates[-1] < rates[0], proc.stdout  # annealed at least once


@pytest.mark.parametrize(("bound", "label"), [(0.01, "degraded"), (0.05, "equivalent")])
def test_a_bound_for_a_loss_metric_is_in_nats(bound: float, label: str) -> None:
    """The docs' rule for a metric minimised in nats: a bound ``b`` allows a perplexity ``exp(b)`` times the
    reference's. A validation loss 0.04 nats above fp32's (perplexity 4% higher) passes 0.05, not 0.01."""
    band = ReferenceBand.of([([], 4.000), ([], 4.004)])  # two fp32 seeds' validation loss
    verdict = judge([], 4.04, band, reference_metric=4.0, max_accuracy_loss=bound, metric_direction="minimize")
    assert verdict.label == label, verdict.evidence
    assert math.exp(verdict.accuracy_loss) == pytest.approx(1.0408, abs=1e-4)
