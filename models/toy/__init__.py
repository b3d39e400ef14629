"""A small transformer that proves graphcap without MiniMax-M3."""
