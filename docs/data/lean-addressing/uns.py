exec(open('.whl/s17/desc.py').read())
reps = [("const int use = it0 + t;", "const unsigned use = it0 + t;"),
        ("    const int slot = t % T::kStages;\n    const u32 parity = (t / T::kStages) & 1;",
         "    const int slot = unsigned(t) % T::kStages;\n    const u32 parity = (unsigned(t) / T::kStages) & 1;"),
        ("&bars.v_empty[(it0 + u - 1) % T::kStages]", "&bars.v_empty[unsigned(it0 + u - 1) % T::kStages]")]
for a, b in reps:
    code = code.replace(a, b)
