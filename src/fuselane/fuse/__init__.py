"""The shared optimizer: pattern views, the rewriter, the rule table, and the pass that applies it."""
