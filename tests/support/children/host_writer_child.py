"""One writer process of a multi-host run, for tests/e2e/test_store_urls.py.

    python tests/support/children/host_writer_child.py STORE RUN_ID STEPS LOW HIGH [STORAGE_OPTIONS_JSON]

Its host is MOESCOPE_HOST and its rank RANK (WORLD_SIZE), from the environment, as a fleet's
process gets them; credentials for a URL store come from the environment too. It records STEPS
forwards of a tiny Mixtral on token ids drawn from [LOW, HIGH) (hosts given different ranges
route differently), tagged by domain, into run RUN_ID, and exits 0 once its writer has closed.
"""

from __future__ import annotations

import json
import sys

import torch


def main(argv: list[str]) -> int:
    store, run_id, steps, low, high = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    options = json.loads(argv[5]) if len(argv) > 5 else None
    import moescope
    from tests.support.zoo import tiny_model

    model = tiny_model("mixtral", seed=0)  # the same weights in every process: one model, many hosts
    generator = torch.Generator().manual_seed(low * 1000 + high)
    with moescope.attach(model, store=store, storage_options=options, run_id=run_id, routes=True) as session, \
            torch.no_grad():
        for step in range(steps):
            with session.tag(domain="even" if step % 2 == 0 else "odd"):
                model(torch.randint(low, high, (2, 8), generator=generator))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
