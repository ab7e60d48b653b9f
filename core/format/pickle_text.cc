#include "core/format/pickle_text.h"

namespace ucp::pickle {

namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

bool IsValidUtf8(std::string_view bytes, bool allow_surrogates) {
  size_t i = 0;
  while (i < bytes.size()) {
    const auto b0 = static_cast<uint8_t>(bytes[i]);
    if (b0 < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    uint32_t min;
    if ((b0 & 0xe0) == 0xc0) {
      len = 2, cp = b0 & 0x1f, min = 0x80;
    } else if ((b0 & 0xf0) == 0xe0) {
      len = 3, cp = b0 & 0x0f, min = 0x800;
    } else if ((b0 & 0xf8) == 0xf0) {
      len = 4, cp = b0 & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (bytes.size() - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto b = static_cast<uint8_t>(bytes[i + k]);
      if ((b & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3f);
    }
    if (cp < min || cp > 0x10ffff) return false;
    if (!allow_surrogates && cp >= 0xd800 && cp <= 0xdfff) return false;
    i += len;
  }
  return true;
}

void AppendUtf8(std::string& out, uint32_t code_point) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xc0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xe0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (code_point >> 18));
    out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  }
}

std::optional<std::string> DecodeRawUnicodeEscape(std::string_view bytes) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    if (bytes[i] != '\\') {
      AppendUtf8(out, static_cast<uint8_t>(bytes[i++]));
      continue;
    }
    size_t run = 0;
    while (i < bytes.size() && bytes[i] == '\\') {
      out += '\\';
      ++i;
      ++run;
    }
    if (run % 2 == 0 || i >= bytes.size() || (bytes[i] != 'u' && bytes[i] != 'U')) continue;
    out.pop_back();  // the odd backslash introduces the escape
    const size_t digits = bytes[i] == 'u' ? 4 : 8;
    ++i;
    if (bytes.size() - i < digits) return std::nullopt;
    uint32_t cp = 0;
    for (size_t k = 0; k < digits; ++k) {
      const int d = HexDigit(bytes[i + k]);
      if (d < 0 || cp > 0x10ffff) return std::nullopt;
      cp = (cp << 4) | static_cast<uint32_t>(d);
    }
    if (cp > 0x10ffff) return std::nullopt;
    i += digits;
    AppendUtf8(out, cp);
  }
  return out;
}

std::optional<std::string> DecodeEscapedString(std::string_view bytes) {
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const char c = bytes[i++];
    if (c != '\\') {
      out += c;
      continue;
    }
    if (i >= bytes.size()) return std::nullopt;
    const char e = bytes[i++];
    switch (e) {
      case '\n':
        break;
      case '\\':
      case '\'':
      case '"':
        out += e;
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x': {
        if (bytes.size() - i < 2) return std::nullopt;
        const int hi = HexDigit(bytes[i]);
        const int lo = HexDigit(bytes[i + 1]);
        if (hi < 0 || lo < 0) return std::nullopt;
        out += static_cast<char>((hi << 4) | lo);
        i += 2;
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          unsigned value = static_cast<unsigned>(e - '0');
          for (int k = 0; k < 2 && i < bytes.size() && bytes[i] >= '0' && bytes[i] <= '7'; ++k) {
            value = (value << 3) | static_cast<unsigned>(bytes[i++] - '0');
          }
          out += static_cast<char>(value & 0xff);
        } else {
          out += '\\';
          out += e;
        }
        break;
    }
  }
  return out;
}

}  // namespace ucp::pickle
