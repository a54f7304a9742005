"""Write a folder of real JPEGs in class subfolders, ImageNet-sized by default (about 500x375).

    python -m benchmarks.workloads.make_jpegs OUT_DIR --images 12800 --classes 100

Each image is its class's colour under a smooth random pattern and pixel noise, so the classes can be
learned and the files compress like photographs (about 80 KB at 500x375; ImageNet's average is 110). The
sizes vary (width ``--min-size`` to ``--max-size``, aspect ratios 4:3, 3:2, 1:1 and 3:4) so decoders
and crops see the variety of a real data set. Deterministic for a seed; written by one process per core.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ASPECTS = (3 / 4, 2 / 3, 1.0, 4 / 3)  # height / width


def class_color(label: int) -> tuple[int, int, int]:
    """A distinct, fixed RGB colour per class (golden-ratio hues)."""
    import colorsys

    r, g, b = colorsys.hsv_to_rgb((label * 0.618034) % 1.0, 0.7, 0.85)
    return int(r * 255), int(g * 255), int(b * 255)


def _write(job: tuple[str, int, int, int, int, int]) -> int:
    import numpy as np
    from PIL import Image

    path, label, width, height, seed, quality = job
    rng = np.random.default_rng(seed)
    # A smooth pattern (a coarse grid upsampled) over the class colour, then pixel noise: JPEG then
    # spends its bits about as a photograph's would.
    coarse = (rng.normal(0, 40, size=(6, 8, 3)).clip(-127, 127) + 128).astype(np.uint8)
    pattern = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR), np.int16)
    image = pattern + np.array(class_color(label), np.int16) - 128
    image += rng.integers(-25, 26, size=image.shape, dtype=np.int16)  # uniform noise, sd 15: cheap to draw
    Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(path, quality=quality)
    return os.path.getsize(path)


def generate(
    root: os.PathLike | str,
    *,
    images: int,
    classes: int,
    min_size: int = 440,
    max_size: int = 500,
    quality: int = 90,
    seed: int = 0,
    workers: int | None = None,
) -> dict[str, float]:
    """Write ``images`` JPEGs into ``root/class_NNN/`` and return counts, bytes and seconds.

    Args:
        root: Output folder (created; existing files of the same names are overwritten).
        images: How many images, spread evenly over the classes.
        classes: How many class subfolders.
        min_size, max_size: Range of image widths in pixels; heights follow from the aspect ratio.
        quality: JPEG quality.
        seed: Fixes sizes and pixels.
        workers: Processes; one per core by default, 0 writes in this process.
    """
    start = time.perf_counter()
    root = Path(root)
    rng = random.Random(seed)
    jobs = []
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        label = i % classes
        width = rng.randint(min_size, max_size)
        height = max(8, round(width * rng.choice(ASPECTS)))
        path = root / f"class_{label:03d}" / f"img_{i:06d}.jpg"
        jobs.append((str(path), label, width, height, seed * 1_000_003 + i, quality))
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers == 0:
        sizes = [_write(job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            sizes = list(pool.map(_write, jobs, chunksize=max(1, len(jobs) // (workers * 8))))
    return {"images": images, "classes": classes, "mean_kb": sum(sizes) / len(sizes) / 1024,
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--images", type=int, default=12_800)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--min-size", type=int, default=440)
    parser.add_argument("--max-size", type=int, default=500)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    stats = generate(args.out, images=args.images, classes=args.classes, min_size=args.min_size,
                     max_size=args.max_size, quality=args.quality, seed=args.seed, workers=args.workers)
    print(f"wrote {stats['images']} JPEGs in {stats['classes']} classes to {args.out}: "
          f"{stats['mean_kb']:.0f} KB each on average, {stats['seconds']:.1f} s")


if __name__ == "__main__":
    main()
