"""Print a study's trials as a markdown table (used for benchmarks/results/*.md).

    python -m benchmarks.tables.study_table STORAGE_URL STUDY
"""

import sys

import optuna

from autotune import TrialConfig
from autotune._records import summarize_study


def main(storage: str, name: str) -> None:
    study = optuna.load_study(study_name=name, storage=storage)
    result = summarize_study(study)
    print("| # | status | config | samples/s (median of windows) | window spread | data wait | peak GiB | accuracy loss | feasible |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---|")
    for t in study.trials:
        a = t.user_attrs
        if "config" not in a or t.values is None:
            continue
        note = " (the fp32 reference run)" if a.get("role") == "reference" else ""
        if "duplicate_of" in a:
            note = f" (proposed again: copy of #{a['duplicate_of']})"
        spread = f"{a['throughput_spread'] * 100:.0f}%" if a.get("status") == "ok" and "throughput_spread" in a else ""
        feasible = "yes" if all(v <= 0 for v in t.constraints.values()) else "no"
        print(f"| {t.number} | {a['status']} | {TrialConfig.from_dict(a['config']).describe()}{note} | "
              f"{t.values[0]:,.0f} | {spread} | {a.get('data_wait_fraction', 0):.2f} | {a.get('peak_memory_gib', 0):.2f} | "
              f"{t.values[1]:.3f} | {feasible} |")
    confirmation = study.user_attrs.get("top_k_confirmation")
    if confirmation:
        print("\nTop-K re-measurement in alternation (A B C A B C ...), samples/s:\n")
        for number, values in confirmation["throughputs"].items():
            print(f"- trial #{number}: {', '.join(f'{v:,.0f}' for v in values)}; median {confirmation['medians'][number]:,.0f}")
    if result.best:
        print(f"\nBest: trial #{result.best.number}, `{result.best.config.describe()}`, {result.best.throughput:,.0f} samples/s; "
              f"baseline {result.baseline_throughput:,.0f}; speed-up {result.speedup:.2f}x.")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
