// Text codecs shared by the unpickler and the pickler: UTF-8 validation with and without
// surrogates (Python's 'strict' and 'surrogatepass'), and Python 2 string escapes.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ucp::pickle {

// True when `bytes` is well-formed UTF-8: shortest forms only, code points up to U+10FFFF.
// With `allow_surrogates`, U+D800..U+DFFF encoded as three bytes are accepted too, as Python's
// 'surrogatepass' error handler writes them for strs holding lone surrogates.
bool IsValidUtf8(std::string_view bytes, bool allow_surrogates);

// Appends the UTF-8 encoding of `code_point` (<= U+10FFFF; surrogates encoded as three bytes).
void AppendUtf8(std::string& out, uint32_t code_point);

// Python's 'raw-unicode-escape' decoding (protocol 0 UNICODE operands): bytes are Latin-1
// except that \uXXXX and \UXXXXXXXX after an odd number of backslashes are escapes. Returns
// UTF-8, or nullopt for a truncated or out-of-range escape.
std::optional<std::string> DecodeRawUnicodeEscape(std::string_view bytes);

// Python's codecs.escape_decode (protocol 0 STRING operands, quotes removed): \\ \' \" \a \b
// \f \n \r \t \v, \ooo octal, \xhh, and backslash-newline; any other backslash stays. Returns
// the bytes, or nullopt for a malformed \x escape or a trailing lone backslash.
std::optional<std::string> DecodeEscapedString(std::string_view bytes);

}  // namespace ucp::pickle
