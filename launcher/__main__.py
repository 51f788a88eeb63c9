"""`python -m launcher serve [every flag of moe-serve serve]`, run under torchrun on each node."""
import sys

from launcher.worker import main

sys.exit(main())
