// AMX tile state, shared by amx_gemm.h (the tiled GEMM) and amx_attention.h (paged attention):
// KVS_AMX (built with AMX-TILE, AMX-BF16 and AVX512-BF16, on Linux), usable() and the tiles'
// configuration.
//
// No include guard on purpose (as transpose16.h): decode_stack.cpp includes both users into their
// own namespaces, and each needs its own definitions. The includer puts <immintrin.h>,
// <strings.h>, <sys/syscall.h>, <unistd.h>, <cstdlib> and <cstring> at file scope first.
//
// Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM): usable()
// asks once per namespace (the request is idempotent); a refused request leaves the AVX512-BF16
// kernels in use. KVSERVE_TILED_AMX=0/false/no/off turns every AMX path off (the A/B switch).
#ifndef KVS_AMX
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KVS_AMX 1
#else
#define KVS_AMX 0
#endif
#endif

#if KVS_AMX
inline bool usable() {
  static const bool ok = [] {
    const char* env = std::getenv("KVSERVE_TILED_AMX");
    if (env != nullptr && (!std::strcmp(env, "0") || !strcasecmp(env, "false") || !strcasecmp(env, "no") ||
                           !strcasecmp(env, "off")))
      return false;
    constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every one of the 8 tiles 16 rows x 64 bytes, on the calling thread (release with _tile_release()).
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#else
inline bool usable() { return false; }
#endif
