from numba_flash.research.cli import main

raise SystemExit(main())
