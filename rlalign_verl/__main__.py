from rlalign_verl.cli import main

raise SystemExit(main())
