from numba_flash.cli import main

raise SystemExit(main())
