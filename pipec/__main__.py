from pipec.cli import main

raise SystemExit(main())
