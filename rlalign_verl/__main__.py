from rlalign_verl.tools.cli import main

raise SystemExit(main())
