"""ResNet-18 image classifier: architecture, weights, exports, verification and archives."""
