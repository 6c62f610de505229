from ._tiers.cli import main

raise SystemExit(main())
