"""Numerics contracts: how a lane keeps or quantizes what it computes, and the bounds tests derive from them."""
