import sys

from shardtrain.cli.app import main

sys.exit(main())
