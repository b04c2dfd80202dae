"""Weight transfer trainer -> engine: bucket planning and packing, the gloo group, peft name mapping, NCCL."""
