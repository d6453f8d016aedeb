"""Training: advantages, losses, optimizer/LR schedule and the actor that applies updates."""
