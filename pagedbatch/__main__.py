from pagedbatch.cli import main

raise SystemExit(main())
