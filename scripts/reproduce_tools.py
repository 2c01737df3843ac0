"""On-policy distillation with tools against supervised distillation on tool transcripts, on a toy agentic task:
``--task tools`` (``lightning_gkd.toy.tools``: two lookups and an addition through tools, then the answer) or
``--task recovery`` (``lightning_gkd.toy.recovery``: two reads of copied codes, where a miscopied code is a tool error
to recover from). The study itself is ``lightning_gkd.studies.tools_study``; it writes docs/results_<task>.json and
the task's section of docs/results.md.

    python scripts/reproduce_tools.py --workers 2                                        # tools, 3 seeds
    python scripts/reproduce_tools.py --task recovery --compute-matched --workers 2      # recovery, 3 seeds
    python scripts/reproduce_tools.py --fast --out /tmp/t                                # a smoke test
    python scripts/reproduce_tools.py --task recovery --rerender                         # the section from its JSON
"""

from __future__ import annotations

import sys

from lightning_gkd.studies.tools_study import main

if __name__ == "__main__":
    sys.exit(main())
