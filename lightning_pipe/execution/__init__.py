"""Running a schedule on one pipeline rank: the interpreter, point-to-point transport, the split
of backward into input and weight gradients, activation recomputation and deferred BatchNorm."""
