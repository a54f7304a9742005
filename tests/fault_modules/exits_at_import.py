"""A script that exits when imported: its ``sys.exit`` is not guarded by ``if __name__ == '__main__'``."""

import sys


def train(ctx) -> None:
    pass


sys.exit(0)
