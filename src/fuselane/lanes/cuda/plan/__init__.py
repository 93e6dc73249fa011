"""The cuda lane's plan side: its knobs, its kernel facts, its shim (`supports`, `fits`, `activation`) and its
own rules. Plain Python: it imports neither torch nor Triton, so a plan is built and explained anywhere."""
