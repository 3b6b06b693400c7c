"""`python -m services.plan ...` runs the same CLI as `burstrl plan`."""

from services.plan.cli import main

raise SystemExit(main())
