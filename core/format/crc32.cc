#include "core/format/crc32.h"

#include <array>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ucp {
namespace {

constexpr uint32_t kPolynomial = 0xEDB88320u;  // reflected 0x04C11DB7

using Tables = std::array<std::array<uint32_t, 256>, 16>;

// tables[0] is the classic byte table; tables[k][b] is the CRC of byte b followed by k zero
// bytes, which lets slicing-by-16 fold 16 input bytes with 16 independent lookups.
constexpr Tables MakeTables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][i] = c;
  }
  for (size_t k = 1; k < 16; ++k) {
    for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
  return t;
}

constexpr Tables kTables = MakeTables();

inline uint32_t LoadLe32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap32(v);
  return v;
}

// `state` is the pre-inverted running register (~crc), as in the helpers below.
uint32_t Slice16(const unsigned char* p, size_t n, uint32_t state) {
  const auto& t = kTables;
  while (n >= 16) {
    const uint32_t a = LoadLe32(p) ^ state;
    const uint32_t b = LoadLe32(p + 4);
    const uint32_t c = LoadLe32(p + 8);
    const uint32_t d = LoadLe32(p + 12);
    state = t[15][a & 0xFF] ^ t[14][(a >> 8) & 0xFF] ^ t[13][(a >> 16) & 0xFF] ^ t[12][a >> 24] ^
            t[11][b & 0xFF] ^ t[10][(b >> 8) & 0xFF] ^ t[9][(b >> 16) & 0xFF] ^ t[8][b >> 24] ^
            t[7][c & 0xFF] ^ t[6][(c >> 8) & 0xFF] ^ t[5][(c >> 16) & 0xFF] ^ t[4][c >> 24] ^
            t[3][d & 0xFF] ^ t[2][(d >> 8) & 0xFF] ^ t[1][(d >> 16) & 0xFF] ^ t[0][d >> 24];
    p += 16;
    n -= 16;
  }
  while (n-- > 0) state = (state >> 8) ^ t[0][(state ^ *p++) & 0xFF];
  return state;
}

#if defined(__x86_64__)

#define UCP_PCLMUL __attribute__((target("pclmul,sse4.1")))

UCP_PCLMUL inline __m128i Load128(const unsigned char* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}

// x carried forward by the distance that the constant pair k encodes, added to `next`: low half
// times the first constant, high half times the second.
UCP_PCLMUL inline __m128i Fold(__m128i x, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

// Folding with carry-less multiplication (Gopal et al., "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ Instruction", Intel 2009), in the bit-reflected domain. Each
// constant is x^n mod P(x), bit-reflected and shifted left by one (computed from P(x)):
//   k1 = x^(4*128+32), k2 = x^(4*128-32)   fold 512 bits forward by 512
//   k3 = x^(128+32),   k4 = x^(128-32)     fold 128 bits forward by 128
//   k5 = x^64                              reduce 96 bits to 64
//   P' = reflected P (33 bits), mu = reflected floor(x^64 / P)   Barrett reduction to 32 bits
// Takes n >= 64 and a multiple of 16; returns the new pre-inverted register.
UCP_PCLMUL uint32_t FoldPclmul(const unsigned char* p, size_t n, uint32_t state) {
  const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
  const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124);
  const __m128i poly_mu = _mm_set_epi64x(0x1f7011641, 0x1db710641);
  const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);

  __m128i x1 = _mm_xor_si128(Load128(p), _mm_cvtsi32_si128(static_cast<int>(state)));
  __m128i x2 = Load128(p + 16);
  __m128i x3 = Load128(p + 32);
  __m128i x4 = Load128(p + 48);
  p += 64;
  n -= 64;
  while (n >= 64) {
    x1 = Fold(x1, k1k2, Load128(p));
    x2 = Fold(x2, k1k2, Load128(p + 16));
    x3 = Fold(x3, k1k2, Load128(p + 32));
    x4 = Fold(x4, k1k2, Load128(p + 48));
    p += 64;
    n -= 64;
  }
  x1 = Fold(x1, k3k4, x2);
  x1 = Fold(x1, k3k4, x3);
  x1 = Fold(x1, k3k4, x4);
  while (n >= 16) {
    x1 = Fold(x1, k3k4, Load128(p));
    p += 16;
    n -= 16;
  }

  // 128 → 64 bits: low half times k4, added to the high half.
  __m128i t = _mm_clmulepi64_si128(x1, k3k4, 0x10);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
  // 96 → 64 bits.
  t = _mm_srli_si128(x1, 4);
  x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00);
  x1 = _mm_xor_si128(x1, t);
  // Barrett reduction: q = (low 32 bits * mu) mod x^32, then remove q * P.
  t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly_mu, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), poly_mu, 0x00);
  x1 = _mm_xor_si128(x1, t);
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

uint32_t UpdatePclmul(const unsigned char* p, size_t n, uint32_t state) {
  if (n >= 64) {
    const size_t bulk = n & ~size_t{15};
    state = FoldPclmul(p, bulk, state);
    p += bulk;
    n -= bulk;
  }
  return Slice16(p, n, state);
}

#undef UCP_PCLMUL

#endif  // __x86_64__

using UpdateFn = uint32_t (*)(const unsigned char*, size_t, uint32_t);

struct Implementation {
  UpdateFn update;
  std::string_view name;
};

Implementation Choose() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")) {
    return {UpdatePclmul, "pclmul"};
  }
#endif
  return {Slice16, "slice16"};
}

const Implementation& Chosen() {
  static const Implementation impl = Choose();
  return impl;
}

// Polynomials over GF(2) modulo the CRC polynomial, in the CRC's reflected bit order: bit 31 is
// x^0, bit 0 is x^31.
constexpr uint32_t kOne = uint32_t{1} << 31;

// a·b mod P.
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t term = kOne; term != 0; term >>= 1) {
    if ((a & term) != 0) product ^= b;
    b = (b & 1) != 0 ? (b >> 1) ^ kPolynomial : b >> 1;  // b·x
  }
  return product;
}

// x^(2^k) mod P for k = 0..66: enough for x^(8·n) with any 64-bit n.
using PowerTable = std::array<uint32_t, 67>;
PowerTable MakePowers() {
  PowerTable powers{};
  powers[0] = kOne >> 1;  // x^1
  for (size_t k = 1; k < powers.size(); ++k) powers[k] = MultiplyModP(powers[k - 1], powers[k - 1]);
  return powers;
}

// x^(8·bytes) mod P: a CRC register moved past `bytes` zero bytes.
uint32_t ShiftOfBytes(uint64_t bytes) {
  static const PowerTable powers = MakePowers();
  uint32_t shift = kOne;
  for (size_t k = 3; bytes != 0; bytes >>= 1, ++k) {
    if ((bytes & 1) != 0) shift = MultiplyModP(powers[k], shift);
  }
  return shift;
}

}  // namespace

// With R(i, m) the register after m from register i, R(i, m) = i·x^(8|m|) ⊕ R(0, m), and
// Crc32(m) = ~R(~0, m); so Crc32(a ‖ b) ⊕ Crc32(b) = (R(~0, a) ⊕ ~0)·x^(8|b|) = Crc32(a)·x^(8|b|).
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return MultiplyModP(crc_a, ShiftOfBytes(length_b)) ^ crc_b;
}

uint32_t Crc32(std::span<const std::byte> data, uint32_t crc) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  return ~Chosen().update(p, data.size(), ~crc);
}

uint32_t Crc32(std::string_view data, uint32_t crc) {
  return Crc32(std::as_bytes(std::span(data.data(), data.size())), crc);
}

uint32_t Crc32Portable(std::span<const std::byte> data, uint32_t crc) {
  return ~Slice16(reinterpret_cast<const unsigned char*>(data.data()), data.size(), ~crc);
}

std::string_view Crc32Implementation() { return Chosen().name; }

}  // namespace ucp
