"""`python -m shared.plan ...` runs the same CLI as `burstrl plan`."""

from shared.plan.cli import main

raise SystemExit(main())
