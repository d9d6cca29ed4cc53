from fedspc_app.experiments.cli import main

raise SystemExit(main())
