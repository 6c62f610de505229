from ._tools.cli import main

raise SystemExit(main())
